"""Steps 4 to 7: a libtorch variant that serves this box's cards, and the
training binary built from the published source against it.

The steps: the state directory, Nix and the lock (`workspace`, step 4);
the variant, by evaluation (`choose`, step 5); the source, fetched, and the
recipe it brings (`source`, step 6); the build (`realise`, step 7); and the
warm path around 5 and 7, which takes what an earlier attempt settled
(`warm`, over `record`). What they are given (`plan`, the build's part of
the plan), the variants a flake offers and which one serves this box
(`variants`), the run manifest and the recipe it makes with the box's own
(`manifest`), and what a build is given and leaves (`outputs`).
"""
