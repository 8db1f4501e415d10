"""The HTTP front: routes and the lean HTTP/1.1 client (app, http1), reading and checking request bodies
(inputs, bigjson), and who may send how much (admission, limits)."""
