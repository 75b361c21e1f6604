"""Command-line data tools, run as `python -m data_tools.<name>`."""
