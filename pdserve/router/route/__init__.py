"""Where a turn goes: the policies behind one seam (policy), sticky hashing (affinity), and what each
choice costs (cost)."""
