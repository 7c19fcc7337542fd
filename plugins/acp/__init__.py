"""apprentice as an Agent Client Protocol agent for editors (see `server.py`)."""
