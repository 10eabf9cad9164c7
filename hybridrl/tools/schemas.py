"""The OpenAI function-calling models a tool is described and called with (verl's names and fields).

A tool YAML's `tool_schema` is validated into OpenAIFunctionToolSchema; the agent loop hands
`model_dump(exclude_unset=True, exclude_none=True)` of it to the chat template. A parsed call from
the model is OpenAIFunctionParsedSchema (arguments as a JSON string), decoded into
OpenAIFunctionCallSchema (arguments as a dict) with a flag telling whether decoding failed.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter. JSON-schema keywords beyond these (items, minimum, default, ...) are kept as given."""
    model_config = ConfigDict(extra="allow")

    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    type: Literal["object"]
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str] = []

    @model_validator(mode="after")
    def required_are_properties(self):
        unknown = [name for name in self.required if name not in self.properties]
        if unknown:
            raise ValueError(f"required names {unknown} are not among properties {sorted(self.properties)}")
        return self


class OpenAIFunctionSchema(BaseModel):
    """parameters may be left out (a function without arguments, as OpenAI and verl allow): no properties."""
    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = OpenAIFunctionParametersSchema(type="object", properties={})
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    type: Literal["function"]
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    """A call as the model wrote it: the name and the arguments as a JSON string."""
    name: str
    arguments: str


class OpenAIFunctionCallSchema(BaseModel):
    """A decoded call: arguments as a dict."""
    name: str
    arguments: dict[str, Any]

    @staticmethod
    def from_openai_function_parsed_schema(
            parsed_schema: OpenAIFunctionParsedSchema) -> tuple["OpenAIFunctionCallSchema", bool]:
        """The decoded call and whether decoding failed (then arguments is {}: not JSON, or not an object)."""
        try:
            arguments = json.loads(parsed_schema.arguments)
        except json.JSONDecodeError:
            return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments={}), True
        if not isinstance(arguments, dict):
            return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments={}), True
        return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments=arguments), False


class OpenAIFunctionToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """What a tool returns to the conversation: text and/or lists of images and videos (multi-modal tools)."""
    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def media_are_lists(cls, values):
        if not isinstance(values, dict):
            raise ValueError(f"ToolResponse must be built from a dict, got {type(values).__name__}")
        for key in ("image", "video"):
            if values.get(key) is not None and not isinstance(values[key], list):
                raise ValueError(f"ToolResponse.{key} must be a list (wrap a single one: [{key}])")
        return values

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video
