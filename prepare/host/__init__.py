"""What fdl-prepare asks of the host itself, for every step: the one place
that starts subprocesses (`proc`) and the confinement of code that is not
ours (`confine`), locks with a deadline (`locks`), mountinfo (`mounts`),
writable directories proven by writing (`dirs`, also step 3), the state
directory opened without following links (`state`), whether root may
trust a path (`trust`), credentials kept out of every message (`redact`)
and the wording shared by messages (`human`).

Each is imported by its own path (`from prepare.host import proc`): the
CLI's `--help` reaches `redact` through the field table, and must not pay
for the rest.
"""
