"""The gRPC coordinator that sequences versioned weight pushes (docs/coordinator.md).

Server: `uzip coordinator --listen HOST:PORT --state FILE.sqlite3`. Clients use
uzip_serve.push_weights and uzip_serve.WeightReceiver. grpc is imported only here.
"""
