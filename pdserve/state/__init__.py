"""The cluster's state folder and the typed records written there (one writer: the supervisor)."""
