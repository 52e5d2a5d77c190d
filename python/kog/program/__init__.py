"""The model program: the one description of a model, as a list of ops with dependencies, that
the CPU executor, the GPU persistent kernel and prefill all run (docs/ARCHITECTURE.md)."""

from kog.program.opcodes import Buffer, Opcode
from kog.program.schedule import Instruction, ScheduleSpec, build_decode_schedule

__all__ = ["Buffer", "Instruction", "Opcode", "ScheduleSpec", "build_decode_schedule"]
