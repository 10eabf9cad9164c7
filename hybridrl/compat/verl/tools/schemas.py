from hybridrl.tools.schemas import (OpenAIFunctionCallSchema, OpenAIFunctionParametersSchema,
                                    OpenAIFunctionParsedSchema, OpenAIFunctionPropertySchema, OpenAIFunctionSchema,
                                    OpenAIFunctionToolCall, OpenAIFunctionToolSchema, ToolResponse)

__all__ = ["OpenAIFunctionCallSchema", "OpenAIFunctionParametersSchema", "OpenAIFunctionParsedSchema",
           "OpenAIFunctionPropertySchema", "OpenAIFunctionSchema", "OpenAIFunctionToolCall", "OpenAIFunctionToolSchema",
           "ToolResponse"]
