"""The HTTP front: the routes (app), the router's objects composed (compose), who may send how much
(admission, limits), and one span and log line per request (observe)."""
