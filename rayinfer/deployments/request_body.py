"""What every top-level HTTP request body is: strict about JSON's types (`"max_tokens": "3"`
and a token id `false` are 400, not coerced), ignoring unknown fields as OpenAI's server does,
and refusing a string anywhere in it that is not valid Unicode (deployments/valid_unicode.py).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

from rayinfer.deployments.valid_unicode import check_text

# Every HTTP body model: no coercion of strings to numbers or booleans, nor of booleans to ints.
STRICT = ConfigDict(extra="ignore", strict=True)


class RequestBody(BaseModel):
    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body):
        """Every string of the body, nested ones too."""
        return check_text(body)
