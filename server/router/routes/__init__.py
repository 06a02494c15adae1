"""The router's routes, one module per family; ``server/router/app.py`` includes each module's ``router``."""
