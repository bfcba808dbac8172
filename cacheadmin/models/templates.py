"""Prompt templates operators name, and what the gateways saw of each."""

from __future__ import annotations

from django.db import models


class PromptTemplate(models.Model):
    """A prompt shape with variables, named by operators so its hit ratio can
    be followed and its prefix reuse analysed per model version.

    ``text`` is the text of a conversation's first message (or a completion's
    prompt) with Python format-style placeholders: ``{customer}`` is a
    variable, ``{{`` and ``}}`` are literal braces. ``samples`` is a list of
    objects, each giving every variable a value. The gateway recognises a
    request by the template's fixed leading text (before the first variable),
    whose fingerprint is ``fixed_chars`` characters long.

    A template of no tenant (global) applies to every tenant; a tenant's own
    template with the same fixed text wins over it.

    Names are unique across the global templates and every tenant's: a name is
    the ``template`` label of the gateway's metrics, which carry no tenant, so
    two templates of one name would add up in one series. Two templates a
    tenant's requests could match with the same precedence (two global ones,
    or two of one tenant) never share their fixed text (``fixed_digest``):
    which one the gateway recognised would be arbitrary.
    """

    name = models.CharField(max_length=64, help_text="Letters, digits, '.', '_' and '-': it is a metric label.")
    tenant = models.ForeignKey(
        "cacheadmin.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="prompt_templates"
    )
    text = models.TextField()
    samples = models.JSONField(default=list, help_text="list of {variable: value} objects")
    #: Characters of fixed text before the first variable (what the gateway matches).
    fixed_chars = models.PositiveIntegerField(default=0)
    #: BLAKE2b-128 (hex) of the fixed text as the gateway matches it (its first
    #: 4,096 characters, :func:`gateway.templates.fingerprint`). NULL only for
    #: templates that already shared their fixed text with an older one when
    #: this became unique (migration 0015); every new template has one.
    fixed_digest = models.CharField(max_length=32, null=True, blank=True, editable=False)
    created_by = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name", "id"]
        constraints = [
            models.UniqueConstraint(fields=["name"], name="prompt_template_name_unique"),
            models.UniqueConstraint(fields=["tenant", "fixed_digest"], name="prompt_template_fixed_text_per_tenant"),
            models.UniqueConstraint(
                fields=["fixed_digest"], condition=models.Q(tenant__isnull=True), name="prompt_template_fixed_text_global"
            ),
        ]

    def __str__(self) -> str:
        return self.name


class TemplateStat(models.Model):
    """Answered requests of one template in one namespace in one minute (UTC),
    and how many of them were warm (some prompt tokens came from a cache:
    a response or semantic hit, or cached prompt tokens reported by the engine).
    Counts add up across gateway processes."""

    template = models.ForeignKey(PromptTemplate, on_delete=models.CASCADE, related_name="stats")
    namespace = models.ForeignKey("cacheadmin.CacheNamespace", on_delete=models.CASCADE, related_name="template_stats")
    minute = models.DateTimeField()
    requests = models.BigIntegerField(default=0)
    warm = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["-minute", "template_id", "namespace_id"]
        constraints = [models.UniqueConstraint(fields=["template", "namespace", "minute"], name="template_stat_once_per_minute")]
        indexes = [models.Index(fields=["minute"], name="template_stat_minute")]

    def __str__(self) -> str:
        return f"{self.template_id} in {self.namespace_id} at {self.minute:%H:%M}"
