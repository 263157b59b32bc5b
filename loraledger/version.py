"""The engine version recorded with every binding."""

__version__ = "0.1.0"
