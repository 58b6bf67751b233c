"""The environment variables that carry the HTTP front's API keys to a child process.

Keys never travel on a command line, which any local user can read: the launcher
puts them in the environment of the one child that checks each (the HTTP front
reads both, the tokenizer the admin key). Both the HTTP front (``http/auth.py``)
and the processes and client below it name them, so they live below all of them.
"""

API_KEY_ENV = "RADIXSERVE_API_KEY"
ADMIN_KEY_ENV = "RADIXSERVE_ADMIN_API_KEY"
