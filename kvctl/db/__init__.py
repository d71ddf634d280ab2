"""The metrics database shared by collectors, the CLI and the dashboard (SQLAlchemy 2.0).

No UI imports here: collectors and the agent load this package.
"""
