"""A trainer's own class for the corpus's trainer state (OLMo forks pickle a data-loader checkpoint into
every rank file): its global is `tests.corpus.olmo_data.MixtureCheckpoint`, a module shardstore never imports."""


class MixtureCheckpoint:
    def __init__(self, world_size: int) -> None:
        self.world_size, self.sources = world_size, ["c4", "stack"]
