from hybridrl.tools.gsm8k_tool import Gsm8kTool

__all__ = ["Gsm8kTool"]
