"""Step 2, the dataset source root (`root` is the step): the `sshfs://`
grammar and the sshfs command line (`url`), making or reusing the mount
(`mount`), and the bounded listing of a root that may be a dead mount
(`listing`, whose child is `_list_root`, run as `python -I -S FILE`)."""
