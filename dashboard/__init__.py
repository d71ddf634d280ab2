"""The managers' dashboard (plotly-dash): fleet-wide efficiency across DCs, read from the metrics
database through ``kvctl.db``'s read model only; it never talks to an agent."""
