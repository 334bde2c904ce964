"""Floor L0 — small helpers every floor may use: bounded file reads and atomic writes (``fs``), checks of
user-given numbers (``checks``), versioned pydantic artifacts and their bounded loading (``artifacts``), the one
way to start local worker processes (``procs``), the environment report of ``varuna env`` (``envinfo``),
text from outside made safe to show (``text``), and giving freed heap back after start-up phases (``heap``).
Imports: ``varuna_core.errors`` and ``varuna_core.env`` only.
"""
