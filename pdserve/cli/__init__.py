"""The command line: one thin typer module per command; rendering lives here and in ui/, policy does not."""
