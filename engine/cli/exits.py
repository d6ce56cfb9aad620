"""The exit codes of every `pdo` sub-command (README, "Exit codes")."""

OK = 0  # pass: every rule held, the run's outputs equal the reference
FAILED = 1  # a rule broke, an output differs, a run failed or a fault happened
BAD_INPUT = 2  # the command line or an input file is wrong (the message names file, line, field)
INCOMPLETE = 3  # no verdict: a truncated trace, a solver that gave no answer, a check not judged
INTERNAL = 70  # a bug in pdo itself (sysexits EX_SOFTWARE): one line says so; --debug shows more
INTERRUPTED = 130  # SIGINT
