"""Built-in strategies: each module is a pluggy plugin registered like any outside one."""
