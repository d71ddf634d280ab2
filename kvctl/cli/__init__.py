"""The kvctl command line: thin typer commands over the library."""
