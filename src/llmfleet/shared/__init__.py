"""What every layer above shares: `core` (domain types, errors, config, block hashing; plain
Python) and `wire` (everything that touches protobuf, gRPC or ZMQ framing but no service logic).
"""
