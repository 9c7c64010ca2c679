"""{{name}}: federated LoRA fine-tuning for text classification. Replace `texts` with your data.

`LoraTextTask` loads the pretrained encoder (`task.model`), adds LoRA adapters (peft) and a linear
head; the encoder's own weights stay frozen, so only the adapters and the head travel each round.
The built-in data are short generated sentences about a few topics, with each site skewed toward
some of them, so the project runs out of the box.
"""

from dataclasses import dataclass

import numpy as np

from hpcfed.tasks.lora_text import LoraTextTask

TOPICS = {
    "sport": ["the match", "a goal", "the coach", "the league", "our striker", "the final score", "the season"],
    "space": ["the rocket", "an orbit", "the telescope", "a comet", "the launch pad", "mars", "the astronauts"],
    "cooking": ["the recipe", "fresh basil", "the oven", "a sauce", "the dough", "garlic", "the chef"],
    "computers": ["the compiler", "a kernel patch", "the graphics card", "my laptop", "the driver", "a bug", "linux"],
}
VERBS = ["was great", "needs work", "surprised everyone", "made the news", "is all I think about", "changed today"]


class TopicTask(LoraTextTask):
    @dataclass(kw_only=True)
    class Config(LoraTextTask.Config):
        docs_per_site: int = 48
        label_skew: float = 0.5

        def validate(self):
            super().validate()
            if self.docs_per_site < 1 or self.label_skew <= 0:
                raise ValueError("docs_per_site >= 1 and label_skew > 0 are required")

    def num_labels(self):
        return len(TOPICS)

    def texts(self, split):
        c, names = self.config, sorted(TOPICS)
        mix = np.random.default_rng([self.site.seed, self.site.client_id]).dirichlet(np.full(len(names), c.label_skew))
        probs = mix if split != "test" else np.full(len(names), 1.0 / len(names))
        rng = np.random.default_rng([self.site.seed, self.site.client_id, ["train", "val", "test"].index(split)])
        n = c.docs_per_site if split == "train" else max(16, c.docs_per_site // 2)
        labels = rng.choice(len(names), size=n, p=probs)
        texts = [f"{rng.choice(TOPICS[names[y]])} {rng.choice(VERBS)}, and {rng.choice(TOPICS[names[y]])} too"
                 for y in labels]
        return texts, [int(y) for y in labels]
