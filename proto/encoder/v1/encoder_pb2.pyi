from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("texts", "token_ids", "model", "truncate", "normalize", "model_version", "prompt_name", "packed", "dimensions")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    model: str
    truncate: bool
    normalize: bool
    model_version: int
    prompt_name: str
    packed: bool
    dimensions: int
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., model: _Optional[str] = ..., truncate: _Optional[bool] = ..., normalize: _Optional[bool] = ..., model_version: _Optional[int] = ..., prompt_name: _Optional[str] = ..., packed: _Optional[bool] = ..., dimensions: _Optional[int] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("input_tokens",)
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    input_tokens: int
    def __init__(self, input_tokens: _Optional[int] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("embeddings", "model", "model_version", "usage", "error", "packed", "dimensions")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    model: str
    model_version: int
    usage: Usage
    error: Status
    packed: bytes
    dimensions: int
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., model: _Optional[str] = ..., model_version: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[_Union[Status, _Mapping]] = ..., packed: _Optional[bytes] = ..., dimensions: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model", "model_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_version: int
    def __init__(self, model: _Optional[str] = ..., model_version: _Optional[int] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("name", "version", "source", "dimensions", "max_tokens_per_input", "pooling", "normalize", "vocab_size", "layers", "heads", "graph", "execution_provider", "max_client_batch_size", "max_batch_tokens", "max_queue_size", "max_message_bytes", "sha256", "versions", "prompts", "default_prompt_name", "digest")
    class PromptsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_INPUT_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_PROVIDER_FIELD_NUMBER: _ClassVar[int]
    MAX_CLIENT_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    source: str
    dimensions: int
    max_tokens_per_input: int
    pooling: str
    normalize: bool
    vocab_size: int
    layers: int
    heads: int
    graph: str
    execution_provider: str
    max_client_batch_size: int
    max_batch_tokens: int
    max_queue_size: int
    max_message_bytes: int
    sha256: str
    versions: _containers.RepeatedScalarFieldContainer[int]
    prompts: _containers.ScalarMap[str, str]
    default_prompt_name: str
    digest: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., source: _Optional[str] = ..., dimensions: _Optional[int] = ..., max_tokens_per_input: _Optional[int] = ..., pooling: _Optional[str] = ..., normalize: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., layers: _Optional[int] = ..., heads: _Optional[int] = ..., graph: _Optional[str] = ..., execution_provider: _Optional[str] = ..., max_client_batch_size: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., max_queue_size: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., versions: _Optional[_Iterable[int]] = ..., prompts: _Optional[_Mapping[str, str]] = ..., default_prompt_name: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[GetModelInfoResponse]
    def __init__(self, models: _Optional[_Iterable[_Union[GetModelInfoResponse, _Mapping]]] = ...) -> None: ...
