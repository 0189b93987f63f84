"""`fdl-prepare publish`: build once on the controller, substitute
everywhere. What a publish is asked and gives back (`spec`), its steps in
their order (`steps`), the run manifest it writes last (`manifest`), and a
git checkout's part (`git`)."""

from prepare.publish.spec import Output, Published, PublishSpec
from prepare.publish.steps import publish

__all__ = ["Output", "PublishSpec", "Published", "publish"]
