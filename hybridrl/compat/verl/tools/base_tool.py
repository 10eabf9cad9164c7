from hybridrl.tools.base_tool import BaseTool

__all__ = ["BaseTool"]
