"""The text the stages learn and measure on: chat corpora (`chat`), the evaluation partition
(`splits`), check's workloads, the keep set, the answers contract. Imports hyco.formats and below."""
