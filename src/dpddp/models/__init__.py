"""The built-in models. Import the modules themselves (``dpddp.models.linear``): this package imports nothing."""
