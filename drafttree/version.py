"""drafttree's version (pyproject.toml holds the same): the server's /version and OpenAPI title."""
__version__ = "0.1.0"
