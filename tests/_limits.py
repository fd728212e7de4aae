"""How long a test waits for a program, a rank or a thread: generous, so a loaded machine makes
a test slower, not red; the bound only turns a hang into a failure."""

WAIT_S = 1200.0
