"""Planning policy: the setup search, the per-operator solve of a setup, plan assembly and the
entry policy (:mod:`autopar.planning.entry`)."""
