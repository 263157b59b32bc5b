"""The auto tool-call parsers, as the server's tool modules name them (they live in loraledger.tool_parsers, where
the engine reads them too to put a completion's calls on record)."""

from loraledger.tool_parsers import PARSERS, parse_hermes, parse_llama3_json, parse_mistral

__all__ = ["PARSERS", "parse_hermes", "parse_llama3_json", "parse_mistral"]
