"""The base every layer may import: the logger, byte sizes and budgets, the native library's
loader and what it reports, malloc tuning and the deferral of Ctrl-C. Nothing here imports
another package of infinity."""
