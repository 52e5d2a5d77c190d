"""The model program: the one description of a model, as a list of ops with dependencies, that
the CPU executor, the GPU persistent kernel and prefill (the interpreter) all run
(docs/ARCHITECTURE.md).

    program = program_for(config)     # one function per family (kog.program.families)
"""

from kog.program.batch import TokenBatch
from kog.program.decoder import DecoderSpec, decoder_program
from kog.program.families import FAMILIES, UnknownModelFamily, program_for
from kog.program.opcodes import Buffer, Opcode
from kog.program.program import Instruction, ProgramBuilder, Rows

__all__ = ["FAMILIES", "Buffer", "DecoderSpec", "Instruction", "Opcode", "ProgramBuilder", "Rows", "TokenBatch",
           "UnknownModelFamily", "decoder_program", "program_for"]
