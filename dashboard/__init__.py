"""Manager dashboard (plotly-dash). Empty until the dashboard issue lands."""
