"""Small helpers shared by the server's processes."""
