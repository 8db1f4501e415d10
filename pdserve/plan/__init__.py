"""Pure planning: a validated spec in, the exact processes out. Never starts a process or opens a socket."""
