"""posenc inside other libraries' models: ``posenc.integrations.transformers`` patches Hugging Face models."""
from . import transformers

__all__ = ["transformers"]
