"""The Megatron-core backend (in progress: see issue "The Megatron-core backend"). Only this
package imports megatron; importing it does not."""
