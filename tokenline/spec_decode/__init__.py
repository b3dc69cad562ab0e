"""Speculative decoding's draft proposers (n-gram prompt lookup, suffix trees, the model's MTP head
handed on): token ids in, draft token ids out. No torch; the scheduler asks them for drafts."""
