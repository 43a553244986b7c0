"""The data side: the global-cursor sampler (:mod:`.sampler`), the elastic DataLoader over it
(:mod:`.loader`), how a batch reaches the model (:mod:`.batches`) and the sample audit of what
each committed step trained on (:mod:`.audit`)."""
