"""Generated gRPC code for the prefixmesh.v1 wire contract: ``from proto import prefixmesh_pb2 as pb``."""
