from hybridrl.protocol import DataProto

__all__ = ["DataProto"]
