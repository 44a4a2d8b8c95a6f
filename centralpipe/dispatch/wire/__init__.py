"""What both processes share, torch-free: the messages (``protocol``), their
serialisation and framing (``transport``), plain tables (``plain``), and the
two sides of a worker's shared-memory ring (``ringreader`` the main process's,
``ringwriter`` the worker's). A module here imports nothing from the rest of
``dispatch`` and never torch at import (an item that holds tensors makes the
receiving side import it when it first meets one)."""
