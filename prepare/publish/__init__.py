"""`fdl-prepare publish`: build once on the controller, substitute
everywhere (`steps`)."""

from prepare.publish.steps import Output, Published, PublishSpec, publish

__all__ = ["Output", "PublishSpec", "Published", "publish"]
