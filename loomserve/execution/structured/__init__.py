"""Grammar-constrained decoding (structured output, forced tool calls) with xgrammar."""

from loomserve.execution.structured.grammar import compile_spec, spec_key, validate_structured
from loomserve.execution.structured.manager import RequestGrammar, StructuredManager

__all__ = ["RequestGrammar", "StructuredManager", "compile_spec", "spec_key",
           "validate_structured"]
