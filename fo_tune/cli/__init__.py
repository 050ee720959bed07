"""The ``fo-tune`` command modules, one per command group; the root ``cli.py`` wires them.

``common`` holds what every command shares: the console, the option types and the error mapping.
"""
