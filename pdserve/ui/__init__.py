"""Terminal output: data to stdout, messages to stderr, NO_COLOR, errors as one line plus a hint."""
