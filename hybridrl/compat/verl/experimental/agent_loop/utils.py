from hybridrl.agent_loop.gpt_oss import (add_generation_prompt_for_gpt_oss, build_gpt_oss_tool_response_text,
                                         format_gpt_oss_tool_response_manually)

__all__ = ["add_generation_prompt_for_gpt_oss", "build_gpt_oss_tool_response_text",
           "format_gpt_oss_tool_response_manually"]
