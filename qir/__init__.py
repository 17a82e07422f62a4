"""qir: a compiler for quantized LLM inference blocks."""

from qir import logs
from qir.api import Compiled, compile
from qir.builder import Builder, Value
from qir.graph import Graph
from qir.interpret import interpret
from qir.parser import parse
from qir.printer import print_graph

logs.setup()

__all__ = ["Builder", "Compiled", "Graph", "Value", "compile", "interpret", "parse", "print_graph"]
