"""What the router remembers of D's KV: reuse entries and the decision to offer one to P (reuse), where
entries are kept (store and its in-memory and Redis stores), and the budget of KV held on D (held*)."""
