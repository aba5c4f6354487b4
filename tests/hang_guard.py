"""The one time limit the tests put on a process or a thread they wait for.

A test waits on events (a line on a pipe, a process's exit, a file's appearance), never on a wall-clock budget:
on a shared machine a busy minute is not a failure. The limit below only stops a *hung* process from holding the
suite forever; it is far beyond any run at any load this suite has met (the slowest subprocess runs ~2 minutes on
an idle 2-core machine), so hitting it means a hang, not a slow machine.
"""
#: seconds; a guard against a hang, not a performance limit
HANG_GUARD_S = 3600
